"""A free TCP port on localhost for tests that start process groups or servers."""

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
