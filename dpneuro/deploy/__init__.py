"""Deployments: each party of a run in its own process or machine.

- :mod:`dpneuro.run.roles`: every stage split into a site role and an
  aggregator role (shared with the in-process simulation);
- :mod:`dpneuro.deploy.party`: a site's and the aggregator's whole analysis,
  resumable, over any exchange; the run manifest every party checks;
- :mod:`dpneuro.deploy.sharedfs`: ``dpneuro site`` / ``dpneuro aggregator``
  over a shared folder;
- :mod:`dpneuro.deploy.coinstac`: the COINSTAC computation (``local`` /
  ``remote`` for ``coinstac.start``) and its exchange;
- :mod:`dpneuro.deploy.coinstac_sim`: a local driver that follows COINSTAC's
  message flow against real ``coinstac`` services (tests, dry runs).
"""
