"""dppo-trl's version, in a module of its own that imports nothing: `setup.cfg` reads it statically, the package
exports it as `dppo_trl.__version__`, and the model card reads it from here (the lower layers never import the package
root, which exports the trainers)."""

__version__ = "0.2.0"
