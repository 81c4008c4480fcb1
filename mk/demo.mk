# mk/demo.mk -- `make demo`: a 3-node x 2-process DDP job on this machine (phalanx local), with a worker
# SIGKILL and a node SIGKILL injected; prints live progress and a summary table of detection latency,
# recovery time and steps lost. Finishes in under 2 minutes on 2 cores.
# The script uses the flash checkpoint (--flash): every step goes to each node agent's shared memory, every
# 10th step (and the last one before a failure: save at breakpoint) is persisted to $work/ckpt.
.PHONY: demo

DEMO_STEPS ?= 160
DEMO_ARGS ?=

demo: setup
	@work=$$(mktemp -d /tmp/phalanx-demo.XXXXXX); \
	echo "phalanx demo: logs and checkpoints in $$work"; \
	PHALANX_CHECKPOINT_STORAGE_PATH=$$work/ckpt \
	$(BIN)/phalanx local --nodes 2:3 --nproc-per-node 2 --heartbeat-timeout 3s --replace-delay 0s \
		--inject kill-worker@step=50,node=1,rank=1 --inject kill-node@step=110,node=2 \
		--workdir $$work/cluster --summary-json $$work/summary.json $(DEMO_ARGS) \
		-- examples/ddp_mlp.py --steps $(DEMO_STEPS) --step-time 0.08 --flash --persist-every 10; \
	echo "summary: $$work/summary.json"
