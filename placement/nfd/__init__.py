"""Node Feature Discovery's image-compatibility artifact (NFD v0.17+, experimental `v1alpha1`). Pure.

- `schema`: the artifact's YAML document as NFD's Go types define it (`api/image-compatibility/
  v1alpha1/spec.go` and the `GroupRule` of `api/nfd/v1alpha1`), loaded the way NFD's client
  reads it (YAML -> JSON -> Go structs); `write`: the same document written as NFD's docs write it.
- `features`: a node's features (NFD's `NodeFeature` object, `nfd export features`, or a gpubadge
  server inventory), in NFD's flags / attributes / instances shape.
- `match`: NFD's rule semantics (matchFeatures, matchAny, every match operator, `type: version`,
  `rule.matched` and `varsTemplate` through `template`, Go's text/template without functions),
  evaluated against those features, with the reason each rule fails.
- `budget`: what one evaluation may spend (expressions, RE2 compilation), and `MatchError`.

Anyone can attach an artifact: reading and evaluating one is bounded whatever its bytes
(`schema.DocumentLimits`, the `nfd_*` settings), and past a bound the error names the setting.

What gpubadge writes into an artifact for a scanned image is `placement.exports.nfd`.
"""
