"""The benchmarks (`make bench`): one module per suite, the machine's limits in `benchlib.py`,
the tables in `tables.py`, the runner `run_all.py`, the comparison with other formats in
`peers/`, and the GPU node's benchmark `gpu.py` with `gpu_session.sh`. How and why each
figure is measured: docs/contributing/benchmarks.md."""
