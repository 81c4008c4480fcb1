"""Where the master keeps its durable state and publishes the job status: a file, or, on Kubernetes, a
ConfigMap and the ElasticJob's status (with the watch of the ElasticJob's spec)."""
