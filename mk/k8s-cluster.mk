# mk/k8s-cluster.mk -- a local Kubernetes test cluster for people, and the Kubernetes tests.
#
#   make k8s-up     etcd + kube-apiserver + controller-manager + scheduler, two real nodes (kubelet, containerd,
#                   runc, CNI, kube-proxy, CoreDNS) running the images built here, and phalanx installed by its
#                   Helm chart; prints `export KUBECONFIG=...`. Then: kubectl apply -f examples/elasticjob.yaml
#                   (needs root). K8S_UP_ARGS=--processes: the tests' process kubelet instead (no root, faster).
#   make k8s-down   stops it and removes its state.
#   make test-k8s   the tests under tests/k8s (they start their own cluster; CI=true makes a missing
#                   control plane a failure instead of a skip).
#   make e2e        the e2e/ scenarios: against PHALANX_E2E_KUBECONFIG (kind, any cluster; see e2e/README.md),
#                   else against a control plane and two container nodes of their own (built and imported
#                   first: `make e2e-prepare`). `make test` leaves them to this target; CI runs both.
#   make crds       regenerate crds/ from src/phalanx/operator/crd.py; `make crds-check` fails on drift.

.PHONY: k8s-up k8s-down test-k8s e2e crds crds-check

k8s-up: setup host-packages
	@scripts/go-tools --nodes >/dev/null  # the control plane's programs and the nodes': a kubelet, CoreDNS, ...
	@$(BIN)/python scripts/k8s-cluster up $(K8S_UP_ARGS)

k8s-down:
	@$(BIN)/python scripts/k8s-cluster down

test-k8s: setup go-tools
	$(BIN)/python -m pytest tests/k8s tests/operator $(PYTEST_ARGS)

e2e: setup
	@if [ -z "$${PHALANX_E2E_KUBECONFIG:-}" ]; then $(MAKE) --no-print-directory e2e-prepare; fi
	$(BIN)/python -m pytest e2e --durations=15 $(PYTEST_ARGS)

crds: setup
	$(BIN)/python scripts/gen-crd

crds-check: setup
	$(BIN)/python scripts/gen-crd --check
