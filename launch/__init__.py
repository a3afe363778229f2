"""atoll.launch: the faces of Atoll. The `atoll` command line, the local cluster launcher (a coordinator and
nodes as processes on one machine, for the demo, tests and benchmarks), the demo and its pictures.

It sits above every component: it may import the coordinator, the nodes and compression; nothing below
imports it.
"""
