"""Verify, then patch, all or nothing: which of the plugin's fixes go on in
this vLLM, decided before any of them changes anything.

Every patch module (``vllm_kimi_k3_moe.PATCHES``) declares, as data, the
upstream objects it replaces or relies on::

    TARGETS = ("vllm.some.module:Class.method", ...)

and may define two checks, each given ``find`` (target -> upstream object):

``relied_on(find) -> str | None``
    What differs from what the patch relies on in those objects' code (a
    method it calls looked up by name, an argument it rewrites), ``None``
    where all of it is there.
``in_vllm(find) -> str | None``
    Where vLLM's own code already does what the patch does: the sentence
    that says so (the patch is then not applied), else ``None``.

A patch added later is covered by declaring its ``TARGETS`` (a test fails
until ``python -m vllm_kimi_k3_moe.verification.record`` has recorded its
code on every verified release). How a fix is judged (``verdict``):

1. Its targets' source as installed (``targets.digest``: read from vLLM's
   modules, whatever object other code put in their place) is the code
   recorded on a verified release (``verified_code``): verified, whatever
   the version string says (a new release, a nightly or a fork with that
   code). Where other code (an RL framework, another plugin) replaced a
   target at run time (``targets.replacement``), the fix is ``replaced at
   run time``: it goes on, through the replacement, once the first layer
   proved the fixes with it in place (3. below), the line naming it.
2. Otherwise it is checked on this vLLM: every target is there with the
   signature it had on a verified release (the installed function, reached
   through any replacement that calls on it, else it differs), and
   ``relied_on`` finds nothing missing; ``in_vllm`` then says whether vLLM
   already has the fix.

One fix that differs and nothing is patched: vLLM runs as it would alone,
and one warning line names what differed.

3. Where some fix goes on checked (not verified) code or through a
   replacement, the patches go on, but
   before any layer of the model gets them the first Kimi-K3 layer vLLM
   builds proves them on a small copy of itself (the partition patch's
   ``model_executor.layers.fused_moe.proof``, beside the patches it runs:
   ``first_layer`` holds what is owed, ``small_layer`` builds and checks:
   the same method and kernel, each GPU of the split, unwritten memory
   random, every checkpoint row loaded once at the cold start and again
   updated in place, pads zero).
   Proven: the line says so. Not: every patch is reverted, that layer and
   all others are vLLM alone's, and one warning says what did not hold and,
   for a replacement, names it.
"""
