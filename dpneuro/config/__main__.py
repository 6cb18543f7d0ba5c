"""``python -m dpneuro.config``: the settings table of docs/api.md and site_templates/run.toml."""

from dpneuro.config.docs import main

raise SystemExit(main())
