# mk/k8s.mk -- local Kubernetes control-plane binaries for integration/e2e tests.
# Included from the top-level Makefile:  include mk/k8s.mk
#
#   make k8s-binaries   build (first time: 10-30+ min, from the Go module proxy)
#                       or reuse cached kube-apiserver, kube-controller-manager,
#                       kube-scheduler, kubectl and etcd; prints the bin dir.
#
# Knobs (environment or make variables):
#   PHALANX_K8S_VERSION   Kubernetes release (default pinned in scripts/k8s-binaries)
#   PHALANX_ETCD_VERSION  etcd release (default: the one that Kubernetes release depends on)
#   PHALANX_K8S_CACHE     cache root (default ~/.cache/phalanx/k8s)
#
# Other fragments/recipes can get the bin dir with:
#   K8S_BIN := $(shell $(K8S_BINARIES_SCRIPT) | tail -1)
# (only evaluate that inside recipes or lazily: it triggers a build on a cold cache).
#
# TODO(k8s-up/k8s-down): targets that start/stop etcd + kube-apiserver +
# kube-controller-manager + kube-scheduler on loopback are added separately;
# see hack/k8s-build/NOTES.md for the flags known to work.

K8S_MK_DIR := $(patsubst %/,%,$(dir $(lastword $(MAKEFILE_LIST))))
K8S_ROOT_DIR := $(abspath $(K8S_MK_DIR)/..)
K8S_BINARIES_SCRIPT ?= $(K8S_ROOT_DIR)/scripts/k8s-binaries

.PHONY: k8s-binaries
k8s-binaries: ## Build/cache pinned kube-apiserver, controller-manager, scheduler, kubectl, etcd
	@$(K8S_BINARIES_SCRIPT)
