"""posterior-bench: the runners (``cli``, ``config``, ``experiment``, ``stages``, ``report``,
``results``) and the plumbing they and the methods build on (``data``, ``models``, ``store``,
``training``, ``settings``). See ARCHITECTURE.md for the layers."""
