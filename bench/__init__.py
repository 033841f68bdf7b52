"""The benchmark of wanspec, by role: :mod:`bench.lib`, the simulation library (the event
simulation, acceptance traces, the emulated costs, statistics, prompt sets);
:mod:`bench.studies`, the studies, each one module that writes one results file;
:mod:`bench.net`, the network tools the studies and the tests run (the autoregressive
baseline's server, the padded verifier); and :mod:`bench.publish`, what rewrites the published
pages from the committed results. ``python -m bench`` lists the studies (:mod:`bench.registry`),
``python -m bench STUDY [args]`` runs one. Dependencies point down only: studies and publishing
tools import the libraries and the network tools, never one another; the network tools import
only the libraries; the libraries import neither. The benchmark sits above ``testkit``: the
studies may import all of it, the libraries, network tools and publishing tools only its
network tools (:mod:`testkit.net`: the WAN emulator, the raw-stream client) and
:mod:`testkit.provenance`; ``testkit`` never imports ``bench``. Not imported by the product
packages and not in the wheel: run it from the repository root."""
