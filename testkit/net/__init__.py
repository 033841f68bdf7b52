"""The network tools the tests, ``testkit`` and the benchmark's studies share: the userspace WAN
emulator (:mod:`~testkit.net.wanem`, also a command: ``python -m testkit.net.wanem``) and one raw
session over a v2 connection (:mod:`~testkit.net.stream_ws`). They import the product only."""
