"""Edges for the tests: in-process edges of an in-process root (`make_edge`,
`two_edges`), and a root `fedlang serve` with two edge processes (east and west) for the
kill tests: the clients, the driver in a thread, and everything stopped at the end."""

import re
import threading

import httpx

from fedlang import deploy
from fedlang.deploy.edge import sync as edge_lib

from ..conftest import ServerProcess, run_driver


def make_edge(tmp_path, name, root_url, token, **options):
    """An in-process edge `name` of the root at `root_url` (not connected, not started)."""
    server = deploy.Server(db=tmp_path / f"{name}.db", port=0, key=tmp_path / f"{name}.key",
                           pace=deploy.Pace(min_retry=0.05, max_retry=0.2), tick=0.05)
    return edge_lib.Edge(server, root_url, token, poll=0.2, **options)


def two_edges(tmp_path, root):
    """Population "pop" at `root` (a started in-process server) and its in-process edges
    east and west (`make_edge`)."""
    with deploy.Admin(root.url, root.admin_token) as admin:
        admin.create_population("pop")
        tokens = [admin.create_edge(name, "pop") for name in ("east", "west")]
    return [make_edge(tmp_path, name, root.url, t) for name, t in zip(("east", "west"), tokens)]


def status(url):
    """`GET /v1/status` of `url`, or None while it does not answer."""
    with httpx.Client(base_url=url, timeout=10) as h:
        try:
            return h.get("/v1/status").json()
        except (httpx.TransportError, ValueError):
            return None


def local_round(url):
    """The newest round `url` shows in its status, or None."""
    answer = status(url)
    return answer["rounds"][0] if answer and answer["rounds"] else None


def edge_process(tmp_path, name, root, token, *extra):
    """`fedlang serve --upstream ROOT` in a process of its own, started."""
    (tmp_path / name).mkdir()
    edge = ServerProcess(tmp_path / name / "edge.db", tmp_path / name,
                         extra_args=["--upstream", root.url, "--upstream-token", token, *extra])
    edge.start()
    return edge


def population_token(edge):
    """The population token an edge made at start (from its log)."""
    return re.findall(r"population pop token: (\S+)", edge.log.read_text())[-1]


class RootAndEdges:
    """A root on `db`, population "pop", edges east and west (`west_args`: more options
    for west's command); clients 0-2 go to east, 3-5 to west. On exit the driver thread is
    joined and every process is killed."""

    def __init__(self, db, tmp_path, *, west_args=()):
        self.db, self.tmp_path, self.west_args = db, tmp_path, tuple(west_args)
        self.root = None
        self.edges = []
        self.driver = None
        self.result = {}

    def __enter__(self):
        try:
            self.root = ServerProcess(self.db, self.tmp_path).start()
            with deploy.Admin(self.root.url, self.root.admin_token) as admin:
                admin.create_population("pop")
                for name, extra in (("east", ()), ("west", self.west_args)):
                    self.edges.append(edge_process(self.tmp_path, name, self.root,
                                                   admin.create_edge(name, "pop"), *extra))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    @property
    def east(self):
        return self.edges[0]

    @property
    def west(self):
        return self.edges[1]

    def clients(self, client_threads, tasks, *, urls=None, patience=120):
        """Client i runs `tasks[i]` (its "train" data) at east (i < 3) or west, or at
        `urls[i]` (a proxy in front of its edge); the clients' error lists."""
        out = []
        for i, task in enumerate(tasks):
            edge = self.east if i < 3 else self.west
            out.append(client_threads(deploy.Client(
                urls[i] if urls else edge.url, "pop", population_token(edge), {"train": task},
                max_tasks=1, patience=patience, backoff=(0.05, 0.5))))
        return out

    def drive(self, computation, **options):
        """Runs `computation` at the root (`run_driver`) in a thread."""
        self.driver = threading.Thread(
            target=run_driver,
            args=(self.root.url, self.root.admin_token, self.result, computation),
            kwargs=options)
        self.driver.start()

    def join(self, timeout=180):
        """Waits for the driver; asserts it ended without an error; its result."""
        self.driver.join(timeout=timeout)
        assert not self.driver.is_alive() and "error" not in self.result, self.result
        return self.result

    def __exit__(self, *exc):
        if self.driver is not None:
            self.driver.join(timeout=60)
        for p in [*self.edges, self.root]:
            if p is not None:
                p.kill()
