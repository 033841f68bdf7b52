"""The publishing tools: what rewrites the published pages from the committed results, none from
a new run (:mod:`~bench.publish.tables`: the README's and the benchmark page's tables and the
prose figures, ``python -m bench publish``; :mod:`~bench.publish.figures`: the pictures,
``python -m bench figures``). They import :mod:`bench.lib` only."""
