"""The compile boundary and the kernel cache: (variant, config, target) -> a loadable shared object.
Needs the DSL to compile, nothing but TVM-FFI to load; no GPU for either."""
