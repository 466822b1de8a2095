.PHONY: demo test ci bench bench-quick package docs

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

package:  ## build the sdist and wheel, check them, and try the wheel in a fresh virtualenv
	scripts/package-check.sh

docs:  ## build the documentation site into docs/_build/html (warnings are errors)
	scripts/docs.sh
