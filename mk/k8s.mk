# mk/k8s.mk -- the Go programs the tests run (scripts/go-tools).
# Included from the top-level Makefile:  include mk/k8s.mk
#
#   make go-tools   build (a cold machine: tens of minutes on 2 cores, from the Go module proxy) or find cached
#                   the Kubernetes control plane, etcd, helm, Prometheus, MinIO and scheduler-plugins; prints
#                   their folder. The container nodes' programs (kubelet, kube-proxy, CoreDNS, kube-router,
#                   Kueue) are `scripts/go-tools --nodes`'s. `make test`, `make e2e` and `make k8s-up` run it.
#
# Knobs (environment): PHALANX_K8S_VERSION, PHALANX_HELM_VERSION, ... and PHALANX_GO_TOOLS_CACHE (default
# ~/.cache/phalanx/go-tools); scripts/go-tools lists them.

.PHONY: go-tools
go-tools: ## Build/cache the Go programs the tests run
	@scripts/go-tools
