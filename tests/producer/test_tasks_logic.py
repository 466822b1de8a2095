"""The @task decorator and the registry (no broker)."""

import pytest

from deferred import Task, task
from deferred.producer.tasks import DuplicateTask, UnknownTask, get_task, unregister


@pytest.fixture
def names():
    made = []
    yield made
    for name in made:
        unregister(name)


def test_bare_decorator_registers_under_module_and_qualname(names):
    @task
    def add(a, b):
        return a + b

    names.append(add.name)
    assert isinstance(add, Task)
    assert (
        add.name
        == f"{__name__}.test_bare_decorator_registers_under_module_and_qualname.<locals>.add"
    )
    assert get_task(add.name) is add
    assert add(2, 3) == 5  # still the plain function
    assert add.__name__ == "add"


def test_decorator_with_options(names):
    @task(name="billing.charge", queue="other")
    def charge(amount):
        return amount

    names.append("billing.charge")
    assert charge.name == "billing.charge"
    assert charge.queue == "other"
    assert charge.target_queue == "other"
    assert charge.using(queue="default").target_queue == "default"
    assert charge.target_queue == "other"  # using() returns a copy


def test_duplicate_name_raises(names):
    @task(name="dup.name")
    def first():
        pass

    names.append("dup.name")
    with pytest.raises(DuplicateTask, match=r"dup\.name"):

        @task(name="dup.name")
        def second():
            pass


def test_unknown_name():
    with pytest.raises(UnknownTask):
        get_task("no.such.task")


def test_bad_queue_name_is_refused_at_decoration():
    with pytest.raises(ValueError, match="dots"):

        @task(name="x", queue="a.b")
        def x():
            pass


def test_autodiscovery_registered_the_test_apps_tasks():
    assert get_task("tests.sleepy").name == "tests.sleepy"
    assert get_task("tests.testapp.tasks.record")


def test_check_arguments():
    t = get_task("tests.explode")
    t.check_arguments(("boom",), {})
    with pytest.raises(TypeError, match=r"tests\.explode"):
        t.check_arguments((), {})
    with pytest.raises(TypeError):
        t.check_arguments(("a", "b"), {})
    with pytest.raises(TypeError):
        t.check_arguments((), {"nope": 1})
