export PYTHONUNBUFFERED=1
set -x
nproc; python3 -c "import torch,sys;print(sys.version, torch.__version__, torch.cuda.get_device_name())"
for f in benchmarks/bench_*.py benchmarks/report.py; do python3 $f --help >/dev/null || echo "HELP FAIL $f"; done
R=$OUT/r; mkdir -p $R
timeout 120 python3 benchmarks/bench_overhead.py --quick --kinds 32x4KiB --out $R --name overhead_nopl 2>&1 | tail -25
PYTHONPATH=benchmarks/_mockpl timeout 150 python3 benchmarks/bench_overlap.py --quick --out $R 2>&1 | tee $OUT/overlap.log | tail -60
PYTHONPATH=benchmarks/_mockpl timeout 120 python3 benchmarks/bench_bandwidth.py --quick --out $R 2>&1 | tee $OUT/bw.log | tail -40
PYTHONPATH=benchmarks/_mockpl timeout 120 python3 benchmarks/bench_overhead.py --quick --out $R 2>&1 | tail -40
python3 benchmarks/report.py --results $R
tar czf $OUT/results.tgz -C $OUT r
