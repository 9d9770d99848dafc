"""Build-time code generation: the variant space, template rendering and the ninja build graph.

The serving path never imports this package (or Jinja)."""
