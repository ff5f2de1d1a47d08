"""``ktlite dashboard``: a local web page for every deployment the user can reach.

The page (``static/``, plain HTML, CSS and JavaScript shipped in the package: no CDN, works
offline) is served on 127.0.0.1 by :mod:`ktlite.dashboard.serve`; its JSON API
(:mod:`ktlite.dashboard.app`) answers only with the run's secret
(:mod:`ktlite.dashboard.access`). What it shows comes from what ``ktlite list``, ``ktlite
status`` and ``ktlite logs`` read: the backends' lists (:mod:`ktlite.dashboard.views`), the
pods' status table with their recent calls (:mod:`ktlite.dashboard.timeline`), and the
backends' pod logs (:mod:`ktlite.dashboard.logs`).
"""
