//! Compile-fail tests of `#[derive(Entity, NewRow)]`: each `ui/*.rs` must fail to
//! compile with exactly the errors in its `.stderr` beside it (`TRYBUILD=overwrite`
//! rewrites them after a deliberate change of wording).

#[test]
fn names_that_are_not_plain_identifiers_do_not_compile() {
    trybuild::TestCases::new().compile_fail("tests/ui/*.rs");
}
