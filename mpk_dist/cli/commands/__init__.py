"""Sub-commands of ``mpk-dist``; each module defines ``register(subparsers)``."""
