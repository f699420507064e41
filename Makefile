.PHONY: setup serve test bench

setup:
	scripts/setup.sh

serve:
	scripts/serve.sh

test:
	scripts/test.sh

bench:
	scripts/bench_all.sh
