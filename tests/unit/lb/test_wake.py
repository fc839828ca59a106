"""The wake-up call: a credential of its own (never the admin secret), sent only to a
controller port held by this user."""

from __future__ import annotations

import os
import socket

import pytest

from fleetserve.lb.wake import may_send_to, wake_token
from tests.nobody import nobody_listening


def test_the_wake_token_is_derived_and_reveals_nothing_of_the_secret() -> None:
    a, b = wake_token("s" * 48), wake_token("t" * 48)
    assert a != b and len(a) == 64 and "s" * 8 not in a
    assert wake_token("s" * 48) == a  # the controller derives the same one


def test_a_port_of_this_user_may_be_woken_and_a_free_one_may_not() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        url = f"http://127.0.0.1:{port}/api/v1/services/x/wake"
        assert not may_send_to(url)  # nobody listens: fail closed
        s.listen()
        assert may_send_to(url)
    assert may_send_to("https://controller.example:46580/api/v1/services/x/wake")  # not local


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to listen as `nobody`")
def test_a_port_another_user_took_gets_no_wake_up() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with nobody_listening(port):
        assert not may_send_to(f"http://127.0.0.1:{port}/api/v1/services/x/wake")
