"""The benchmark's network tools: processes and clients the studies and the tests run, each also
a command (``python -m bench.net.NAME``): the cloud-only autoregressive baseline's server and
client (:mod:`~bench.net.ar_server`) and the verifier with padded forwards
(:mod:`~bench.net.verifier`). They import the product, :mod:`bench.lib` and ``testkit`` only, so
that the tests may use them without depending on a study. The WAN emulator and the raw-stream
client, which ``testkit`` needs too, live below the benchmark in :mod:`testkit.net`."""
