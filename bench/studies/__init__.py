"""The studies: each one module with ``main(argv)`` that writes one results file (or folder),
run as ``python -m bench STUDY [args]`` (the list, with what each measures, how long it takes
here and what it writes: ``python -m bench``, :data:`bench.registry.STUDIES`). A study imports
:mod:`bench.lib`, :mod:`bench.net`, ``testkit`` and the product, never another study: what two
studies share lives in :mod:`bench.lib`."""
