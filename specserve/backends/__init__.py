"""Alternative compute backends behind the ModelRunner interface (``--backend``).

Nothing in the torch path imports a backend; ``engine_setup`` imports one lazily
when ``--backend`` names it.
"""
