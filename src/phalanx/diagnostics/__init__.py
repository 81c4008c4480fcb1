"""Health-probe programs (matmul, all-gather), straggler and hang analysis, stack comparison, and
exit-code/log classification. Analysis modules are pure and torch-free; probe programs run in subprocesses."""
