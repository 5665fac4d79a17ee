"""SGLang 0.5.23's own staging code, run from the released wheel without importing sglang.

``sglang_wheel`` finds the wheel and executes SGLang's pure staging helpers and frame codecs;
``decode_machine`` executes the decode-side code that decides (the staging handler, the
listener's entry points, the receiver's poll) around one decode rank. The conformance and
differential tests and the explorer's exposure label (``twin/explore/exposure.py``) use them.
"""
