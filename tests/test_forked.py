"""forked.Child: a value computed in a forked child comes back, a failure says so."""
import marshal
import os

import pytest

from clusterdns import forked


def test_the_childs_value_comes_back_through_the_pipe():
    parent = os.getpid()
    big = [("x" * 1000, i) for i in range(5000)]   # more than a pipe's buffer
    child = forked.Child(lambda: (os.getpid(), big))
    pid, got = child.result()
    assert pid != parent and got == big


def test_marshal_for_tuples_of_strings():
    child = forked.Child(lambda: ("a", ("b", 1)), dumps=marshal.dumps, loads=marshal.loads)
    assert child.result() == ("a", ("b", 1))


def test_an_exception_in_the_child_is_a_failure_here():
    def boom():
        raise ValueError("no")
    child = forked.Child(boom)
    with pytest.raises(forked.ChildFailed):
        child.result()


def test_a_child_that_dies_is_a_failure_here():
    child = forked.Child(lambda: os._exit(3))
    with pytest.raises(forked.ChildFailed, match="status"):
        child.result()
