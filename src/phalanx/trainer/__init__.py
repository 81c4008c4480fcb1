"""Tensor, pipeline and data parallel GPT training that re-forms its process groups in-process when
membership changes."""
