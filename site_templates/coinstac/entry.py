"""COINSTAC entry point of the dpneuro computation (compspec version 2).

COINSTAC starts this in the computation's container; ``coinstac.start`` serves
the ``local`` (site) and ``remote`` (aggregator) iterations over a websocket.
All the logic is in :mod:`dpneuro.deploy.coinstac`, which runs the same site
and aggregator steps as ``dpneuro run``, ``dpneuro site`` and ``dpneuro aggregator``.
"""

import coinstac

from dpneuro.deploy.coinstac import local, remote

if __name__ == "__main__":
    coinstac.start(local, remote)
