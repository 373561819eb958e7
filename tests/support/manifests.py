"""Manifests that must fail, each with the message it must give: shared by manifest and warm tests."""

from __future__ import annotations

MALFORMED = [
    (
        "bad-yaml",
        """
        version: 1
        functions:
          - fn: m:f
            args: [{shape: [batch, 1, dtype: int32}
        """,
        4,
        "invalid YAML",
    ),
    (
        "duplicate-key",
        """
        version: 1
        functions:
          - fn: m:f
            buckets: {batch: [1]}
            buckets: {batch: [2]}
        """,
        5,
        "duplicate key 'buckets' (first given on line 4)",
    ),
    ("not-a-mapping", "- version: 1\n", 1, "a manifest is a mapping"),
    ("version-2", "version: 2\nfunctions: [{fn: m:f}]\n", 1, "unsupported manifest version 2"),
    ("version-string", "version: '1'\nfunctions: [{fn: m:f}]\n", 1, "expected an integer"),
    ("missing-version", "functions: [{fn: m:f}]\n", 1, "version: required field missing"),
    (
        "unknown-top-field",
        """
        version: 1
        functons: []
        """,
        2,
        "unknown field 'functons' (did you mean 'functions'?",
    ),
    ("empty-functions", "version: 1\nfunctions: []\n", 2, "functions: must not be empty"),
    (
        "unknown-arg-field",
        """
        version: 1
        functions:
          - fn: m:f
            args:
              - {shape: [1], dtype: int32}
              - shapes: [2]
        """,
        6,
        "functions[0].args[1].shapes: unknown field 'shapes' (did you mean 'shape'?",
    ),
    (
        "missing-fn",
        """
        version: 1
        functions:
          - fn: m:f
          - name: decode
            args: []
        """,
        4,
        "functions[1].fn: required field missing",
    ),
    (
        "bad-fn-ref",
        """
        version: 1
        functions:
          - name: f
            fn: examples.lm.decode_step
        """,
        4,
        "functions[0].fn: 'examples.lm.decode_step' is not of the form module:attribute",
    ),
    (
        "unknown-axis-in-shape",
        """
        version: 1
        functions:
          - fn: m:f
            args:
              - {shape: [batch, seqlen], dtype: int32}
            buckets:
              batch: [1]
        """,
        5,
        "functions[0].args[0].shape[1]: unknown axis 'seqlen' (declared axes: batch)",
    ),
    (
        "bad-dtype",
        """
        version: 1
        functions:
          - fn: m:f
            args:
              - {shape: [1], dtype: int32}
              - {shape: [1], dtype: int32}
              - shape: [4]
                dtype: bfloat61
        """,
        8,
        "functions[0].args[2].dtype: unknown dtype 'bfloat61' (use a numpy/jax dtype name "
        "such as bfloat16, float32, int32)",
    ),
    (
        "object-dtype",
        "version: 1\nfunctions:\n  - fn: m:f\n    args: [{shape: [1], dtype: object}]\n",
        4,
        "unknown dtype 'object'",
    ),
    (
        "shape-without-dtype",
        "version: 1\nfunctions:\n  - fn: m:f\n    args:\n      - {shape: [1]}\n",
        5,
        "args[0].dtype: required field missing",
    ),
    (
        "shape-and-pytree",
        "version: 1\nfunctions:\n  - fn: m:f\n    args:\n      - {shape: [1], dtype: int8, pytree: m:p}\n",
        5,
        "exactly one of shape (with dtype), pytree or value",
    ),
    (
        "negative-dim",
        "version: 1\nfunctions:\n  - fn: m:f\n    args:\n      - shape:\n        - 2\n        - -1\n        dtype: int8\n",
        7,
        "args[0].shape[1]: a dimension is a non-negative int or an axis name",
    ),
    (
        "axis-not-a-list",
        """
        version: 1
        functions:
          - fn: m:f
            buckets:
              batch: 4
        """,
        5,
        "functions[0].buckets.batch: expected a list, got int 4",
    ),
    (
        "axis-empty",
        "version: 1\nfunctions:\n  - fn: m:f\n    buckets:\n      batch: []\n",
        5,
        "non-empty list",
    ),
    (
        "shape-axis-with-strings",
        """
        version: 1
        functions:
          - fn: m:f
            args: [{shape: [batch], dtype: int8}]
            buckets:
              batch: [1, two]
        """,
        6,
        "buckets.batch[1]: axis 'batch' is used in a shape, so its values must be non-negative ints",
    ),
    (
        "axis-duplicate-value",
        "version: 1\nfunctions:\n  - fn: m:f\n    buckets:\n      batch: [1, 2, 1]\n",
        5,
        "duplicate value 1 in axis 'batch'",
    ),
    (
        "exclude-unknown-axis",
        """
        version: 1
        functions:
          - fn: m:f
            buckets: {batch: [1, 2]}
            exclude:
              - {batch: 1}
              - {bach: 2}
        """,
        7,
        "functions[0].exclude[1].bach: unknown axis 'bach' (declared axes: batch)",
    ),
    (
        "exclude-unknown-value",
        "version: 1\nfunctions:\n  - fn: m:f\n    buckets: {batch: [1, 2]}\n    exclude:\n      - {batch: 16}\n",
        6,
        "16 is not a value of axis 'batch' ([1, 2])",
    ),
    (
        "exclude-everything",
        "version: 1\nfunctions:\n  - fn: m:f\n    buckets: {batch: [1]}\n    exclude:\n      - {batch: 1}\n",
        5,
        "exclude removes every bucket",
    ),
    (
        "kwargs-unknown-axis",
        """
        version: 1
        functions:
          - fn: m:f
            buckets: {batch: [1]}
            kwargs:
              sampling: {axis: mode}
        """,
        6,
        "functions[0].kwargs.sampling.axis: unknown axis 'mode' (declared axes: batch)",
    ),
    (
        "kwargs-bad-mapping",
        "version: 1\nfunctions:\n  - fn: m:f\n    kwargs:\n      opts: {a: 1}\n",
        5,
        "a keyword value is a static literal or {axis: NAME}",
    ),
    (
        "sharding-without-mesh",
        """
        version: 1
        functions:
          - fn: m:f
            args:
              - {shape: [8, 4], dtype: float32, sharding: [data, null]}
        """,
        5,
        "functions[0].args[0].sharding: sharding needs a mesh",
    ),
    (
        "sharding-unknown-mesh-axis",
        """
        version: 1
        functions:
          - fn: m:f
            mesh: {axes: {data: 4}}
            args:
              - shape: [8, 4]
                dtype: float32
                sharding: [data, model]
        """,
        8,
        "args[0].sharding[1]: unknown mesh axis 'model' (mesh axes: data)",
    ),
    (
        "sharding-not-divisible",
        """
        version: 1
        functions:
          - fn: m:f
            mesh: {axes: {data: 4}}
            args:
              - shape: [batch, 4]
                dtype: float32
                sharding: [data]
            buckets: {batch: [4, 6]}
        """,
        8,
        "dimension 0 (batch=6) does not divide by 4",
    ),
    (
        "mesh-size-zero",
        "version: 1\nfunctions:\n  - fn: m:f\n    mesh:\n      axes: {data: 0}\n",
        5,
        "mesh axis 'data' must have a positive size",
    ),
    (
        "mesh-larger-than-target",
        "version: 1\ntarget: {backend: cpu, device_count: 2}\nfunctions:\n  - fn: m:f\n    mesh:\n      axes: {data: 4}\n",
        6,
        "the mesh needs 4 devices but target.device_count is 2",
    ),
    (
        "target-backend",
        "version: 1\ntarget:\n  backend: cuda\nfunctions: [{fn: m:f}]\n",
        3,
        "target.backend: input should be 'cpu', 'gpu' or 'tpu'",
    ),
    (
        "duplicate-function-name",
        """
        version: 1
        functions:
          - fn: a:step
          - fn: b:step
        """,
        4,
        "duplicate function name 'step' (also on line 3)",
    ),
    (
        "donate-out-of-range",
        """
        version: 1
        functions:
          - fn: m:f
            jit:
              donate_argnums: [3]
            args: [{shape: [1], dtype: int8}]
        """,
        5,
        "jit.donate_argnums[0]: 3 is out of range",
    ),
    (
        "static-argnum-on-array",
        "version: 1\nfunctions:\n  - fn: m:f\n    jit: {static_argnums: 0}\n    args: [{shape: [1], dtype: int8}]\n",
        4,
        "give it as {value: ...}",
    ),
    (
        "unknown-jit-option",
        "version: 1\nfunctions:\n  - fn: m:f\n    jit:\n      static_argname: [x]\n",
        5,
        "unknown field 'static_argname' (did you mean 'static_argnames'?",
    ),
]


IMPORT_ERRORS = [
    (
        "unimportable-module",
        {},
        "version: 1\nfunctions:\n  - name: f\n    fn: cm_no_such_module:f\n",
        4,
        "functions[0].fn: cannot import 'cm_no_such_module': no module named 'cm_no_such_module'",
    ),
    (
        "missing-attribute",
        {"cm_attr.py": "def decode_step(x):\n    return x\n"},
        "version: 1\nfunctions:\n  - fn: cm_attr:decode_stp\n    args: [{value: 1}]\n",
        3,
        "'cm_attr' has no attribute 'decode_stp'; did you mean 'decode_step'?",
    ),
    (
        "module-raises",
        {"cm_raises.py": "raise RuntimeError('boom')\n"},
        "version: 1\nfunctions:\n  - fn: cm_raises:f\n",
        3,
        "importing 'cm_raises' failed: RuntimeError: boom",
    ),
    (
        "module-missing-dependency",
        {"cm_dep.py": "import cm_not_installed_dep\n"},
        "version: 1\nfunctions:\n  - fn: cm_dep:f\n",
        3,
        "importing 'cm_dep' failed: ModuleNotFoundError",
    ),
    (
        "not-callable",
        {"cm_const.py": "f = 3\n"},
        "version: 1\nfunctions:\n  - fn: cm_const:f\n",
        3,
        "cm_const:f is not callable: it is int 3",
    ),
    (
        "unimportable-pytree",
        {"cm_pt.py": "def f(p):\n    return p\n"},
        "version: 1\nfunctions:\n  - fn: cm_pt:f\n    args:\n      - {pytree: cm_pt:params}\n",
        5,
        "functions[0].args[0].pytree: 'cm_pt' has no attribute 'params'",
    ),
    (
        "string-kwarg-not-static",
        {"cm_static.py": "def f(x, mode='a'):\n    return x\n"},
        "version: 1\nfunctions:\n  - fn: cm_static:f\n    args: [{shape: [1], dtype: int8}]\n    kwargs:\n      mode: b\n",
        6,
        "kwargs.mode: 'mode' is not an array or number, so jax.jit must treat it as static",
    ),
    (
        "jitted-with-options",
        {"cm_jitted.py": "import jax\n@jax.jit\ndef f(x):\n    return x\n"},
        "version: 1\nfunctions:\n  - fn: cm_jitted:f\n    jit: {donate_argnums: 0}\n    args: [{shape: [1], dtype: int8}]\n",
        4,
        "cm_jitted:f is already jitted",
    ),
    (
        "signature-mismatch",
        {"cm_sig.py": "def f(a, b, c):\n    return a\n"},
        "version: 1\nfunctions:\n  - fn: cm_sig:f\n    args:\n      - {shape: [1], dtype: int8}\n      - {shape: [1], dtype: int8}\n",
        4,
        "functions[0].args: the arguments do not fit cm_sig:f(a, b, c): missing a required argument: 'c'",
    ),
]
