"""kv-canary's workflow beside the generator: the schema-change gate against a base revision
(`abi-check`, `pr-report`: the pre-commit hook and the GitHub Action) and an engine repository's
set-up (`init`). It imports the generator (codegen/, as kv_canary.codegen), never the other way.
"""
