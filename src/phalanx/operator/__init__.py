"""The operator for the ElasticJob custom resource: Kubernetes object builders, reconciliation,
status and conditions. Never imports torch."""
