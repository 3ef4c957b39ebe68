"""Adapters for training frameworks that build the model themselves.

Each submodule imports its framework and is imported only by the user (for instance by
the framework's own custom-import option): ``import lowprec`` never imports them.

* :mod:`lowprec.integrations.torchtitan`: a ``model.converters`` entry for torchtitan.
"""
