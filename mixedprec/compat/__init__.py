"""Apex's API as faces on mixedprec's core.

``amp``, ``fp16_utils``, ``parallel``, ``amp_C``, ``apex_C``, ``multi_tensor_apply``,
``normalization`` and the Apex-signature optimizers (``FusedAdam``, ``FusedSGD``,
``FusedLAMB``, ...). They add Apex's names and defaults on the core (ops, loss scale,
masters, optimizers); the core never imports this package. ``import mixedprec.apex``
makes ``import apex`` resolve to these modules; ``mixedprec.amp`` and the other old
names are kept as aliases of them.
"""
