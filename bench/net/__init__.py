"""The network tools: processes and clients the studies and the tests run, each also a command
(``python -m bench.net.NAME``): the userspace WAN emulator (:mod:`~bench.net.wanem`), the
cloud-only autoregressive baseline's server and client (:mod:`~bench.net.ar_server`), the
verifier with padded forwards (:mod:`~bench.net.verifier`) and one raw session over a v2
connection (:mod:`~bench.net.stream_ws`). They import the product and :mod:`bench.lib` only, so
that ``testkit`` and the tests may use them without depending on a study."""
