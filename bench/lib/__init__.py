"""The simulation library and what the studies share: the discrete-event simulation
(:mod:`~bench.lib.sim`), its simulated cells and users (:mod:`~bench.lib.cells`,
:mod:`~bench.lib.users`), acceptance traces (:mod:`~bench.lib.traces`), the emulated GPU-class
costs (:mod:`~bench.lib.costs`, :mod:`~bench.lib.cost_study`), paired-bootstrap statistics
(:mod:`~bench.lib.stats`), the prompt sets (:mod:`~bench.lib.prompts`), oracle drafts
(:mod:`~bench.lib.oracle`), the real-time modes and edge (:mod:`~bench.lib.modes`,
:mod:`~bench.lib.edge`), what a study reads off a verifier (:mod:`~bench.lib.verifier_state`),
the AR baseline's wire format (:mod:`~bench.lib.ar_wire`), reports and pages. No module here
imports a study or a network tool of :mod:`bench.net`; of ``testkit``, only
:mod:`testkit.provenance` (where a results file came from) and :mod:`testkit.net`."""
