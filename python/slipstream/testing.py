"""Real nodes, etcd and clusters for tests, yours and the project's.

A pipeline's behaviour under serving (batching, deadlines, worker
restarts, a cluster's placement) shows only with the real node and real
worker processes, so these helpers start the real programs as child
processes, each on a free port, and stop them::

    from slipstream.testing import Cluster, Node

    def test_my_app() -> None:
        with Node("app.py", "--request-timeout", "2") as node:   # ready on entry, stopped on exit
            status, body = node.infer("demo", x=[[1.0, 2.0]])
            assert status == 200

    def test_my_app_on_three_nodes() -> None:                     # needs etcd on PATH
        with Cluster("app.py", nodes=3) as cluster:
            status, body = cluster.nodes[0].infer("demo", x=[[1.0, 2.0]])

- ``Node(app, *flags)``: ``slipstream serve APP --port 0 FLAGS`` (``app``: a
  file or ``Pipeline`` objects); its URL is read from the node's
  ``listening on http://HOST:PORT`` line and its readiness from ``ready,
  serving``; ``request``/``get``/``post``/``infer``/``status`` talk to it,
  ``client()`` gives an ``ss.Client``, ``lines`` holds its output.
  ``Node(None, ..., command="node")`` is a cluster member.
- ``Etcd(members)``: real etcd processes forming one cluster in a private
  data directory; ``kill(i)``/``start(i)`` take a member down and back.
- ``deploy(etcd, app)``, ``start_node(etcd, name)``: publish an app to a
  cluster, start one member; ``stop_all(nodes)``: stop members together (one
  by one, each would first hand its stages over to those still running).
- ``Cluster(app, nodes)``: etcd, the app deployed and ``nodes`` members,
  all ready (``subnet=Subnet(["n1", ...])``: each member on a machine of
  its own).
- ``Subnet(names)``: machines on one LAN on this host, a network namespace
  each (needs root); ``partition(name)``/``heal(name)`` cut one off and
  back, ``wrap(name)`` runs a command on one.
- ``wait_for(predicate)``, ``free_port()``.

``ss.launch`` is for scripts and notebooks that want a node in the
background; these are for tests and benchmarks: they expose the process,
its whole output, the signal it is stopped with, and cluster members.
The project's own tests (tests/) and benchmarks (bench/) use them.
"""

from slipstream._internal.testing import (
    CLI,
    TOKEN,
    Cluster,
    Etcd,
    Node,
    Subnet,
    deploy,
    free_port,
    start_node,
    stop_all,
    wait_for,
)

__all__ = ["CLI", "TOKEN", "Cluster", "Etcd", "Node", "Subnet", "deploy", "free_port", "start_node", "stop_all",
           "wait_for"]
