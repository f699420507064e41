.PHONY: setup serve test bench

setup:
	scripts/setup.sh

serve:
	scripts/serve.sh

test:
	scripts/test.sh

bench:
	benchmarks/quick.sh
