"""Running the server (src/fedlang/deploy/server/serve.py): one server per SQLite task
store, a port in use named, nothing held after a failed start."""

import errno
import socket

import pytest

from fedlang import deploy
from fedlang.deploy.server import serve


def test_one_server_holds_an_sqlite_store_until_it_stops(tmp_path):
    db = tmp_path / "store.db"
    with deploy.Server(db=db, port=0):
        with pytest.raises(serve.DatabaseInUse, match=rf"task store {db}, found one holding it"):
            deploy.Server(db=f"sqlite:///{db}", port=0)
        with deploy.Server(db=tmp_path / "other.db", port=0):  # another store: fine
            pass
    with deploy.Server(db=db, port=0):  # released on stop
        pass


def test_a_port_in_use_is_named_and_the_store_is_released(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=rf"Expected port {port} on 127.0.0.1 to be free.*--port") as e:
            deploy.Server(db=tmp_path / "store.db", port=port)
    assert e.value.errno == errno.EADDRINUSE
    with deploy.Server(db=tmp_path / "store.db", port=0):  # the failed start held nothing
        pass
