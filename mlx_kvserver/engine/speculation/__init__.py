"""Speculative decoding: drafts for the running answers, verified in the batch's own pass.

``speculate.py`` (:class:`Speculation`) asks each running answer for a draft, picks the step's
width by what a wider pass costs here (``pass_cost.py``) and takes from one verify pass what
each answer may keep, so greedy answers are the ones plain decoding gives. Drafts come from the
token ids the server holds (``drafts.py``: a client's prediction, the answer's own prompt, other
saved entries) or from a small model with the same tokenizer (``draft_model.py``);
``prediction.py`` follows where an answer is in a client's prediction.
"""
