"""A real Kubernetes control plane on loopback for the tests, plus a test kubelet that runs Pods as local
processes. Used by tests/k8s/conftest.py and by scripts/k8s-cluster (`make k8s-up`)."""
