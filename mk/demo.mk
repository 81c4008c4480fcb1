# mk/demo.mk -- `make demo`: a 3-node DDP job on this machine (phalanx local), with a worker SIGKILL and a
# node SIGKILL injected; prints live progress and a summary table of detection latency, recovery time and
# steps lost. Sized to the cores it finds (DEMO_NPROC processes per node: 1 below 6 cores, else 2), so the
# table shows phalanx's own speed rather than 6 processes queueing for 2 cores. Under 2 minutes on 2 cores.
# The script uses the flash checkpoint (--flash): every step goes to each node agent's shared memory, every
# 10th step (and the last one before a failure: save at breakpoint) is persisted to $work/ckpt.
.PHONY: demo

DEMO_STEPS ?= 260
DEMO_NPROC ?= $(shell n=$$(nproc); echo $$(( n >= 6 ? 2 : 1 )))
DEMO_ARGS ?=

demo: setup
	@work=$$(mktemp -d /tmp/phalanx-demo.XXXXXX); \
	echo "phalanx demo: logs and checkpoints in $$work"; \
	PHALANX_CHECKPOINT_STORAGE_PATH=$$work/ckpt \
	$(BIN)/phalanx local --nodes 2:3 --nproc-per-node $(DEMO_NPROC) --heartbeat-timeout 3s --replace-delay 0s \
		--inject kill-worker@step=50,node=1,rank=$$(( $(DEMO_NPROC) - 1 )) --inject kill-node@step=110,node=2 \
		--workdir $$work/cluster --summary-json $$work/summary.json $(DEMO_ARGS) \
		-- examples/ddp_mlp.py --steps $(DEMO_STEPS) --step-time 0.08 --flash --persist-every 10; \
	echo "summary: $$work/summary.json"
