.PHONY: demo test ci bench bench-quick

demo:  ## run the demo: broker, topology, worker and web server
	scripts/demo.sh

test:  ## run the whole test suite against RabbitMQ
	scripts/test.sh

ci:
	bash .ci/run

bench:  ## the full benchmark run; regenerates docs/bench/
	scripts/bench.sh

bench-quick:  ## the benchmarks at small sizes, under 5 minutes
	scripts/bench.sh --quick
