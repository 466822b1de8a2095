.PHONY: demo test ci

demo:  ## run the demo: broker, topology, worker and web server
	scripts/demo.sh

test:  ## run the whole test suite against RabbitMQ
	scripts/test.sh

ci:
	bash .ci/run
