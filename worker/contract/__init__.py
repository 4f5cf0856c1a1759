"""The contract across the sandbox boundary: what the coordinator and the sandbox side agree
on, and nothing else.  The coordinator (``engine``) imports this package and no other part of
``worker``; the sandbox side imports it too.  Standard library and msgpack only.

Each byte channel between the two sides has one module with its messages, each a typed class
that is both its builder and (through the channel's ``Catalogue``) its checked parser; every
stream is framed by ``framing`` and read with one of its readers:

    channel   between                                  transport                      module
    wire      coordinator <-> worker                   ZeroMQ, a msgpack map a frame  contract.wire
    output    worker -> coordinator                    FIFOs, framed ``Out`` + bytes  contract.output
    fork      coordinator <-> fork server              its stdin/stdout, framed       contract.fork
              fork server <- what it forks for a       a report pipe, framed
              worker (its namespaces' init)
    sample    coordinator <-> sample slot              unix socket, framed            contract.sample
    tools     coordinator <-> tool process             its stdin/stdout, framed JSON  contract.tools
    confiner  coordinator <-> exec FILE's confiner     an argument, two pipes of      contract.confiner
                                                       framed JSON
    start     coordinator -> any process it starts     an environment variable, JSON  contract.start

Shared by all: ``confinement`` (the spec a process applies to itself, a message held in others,
and what this kernel can apply), ``limits`` (bounds, the interrupt signal, head-and-tail
output), ``schema`` (how a message is declared and parsed, messages held in messages included),
``bounded_json`` (the one JSON parser for text a worker, a tool process or a model sent: bounded
nesting and numbers, refused in words).
"""

__all__: list[str] = []
