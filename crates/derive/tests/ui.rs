//! Compile-fail tests of `#[derive(Entity, NewRow)]` (names that are not plain SQL
//! identifiers, two fields on one column, an attribute given twice, a user key of a
//! smaller integer; rows placed by a column their entity does not read by fail in
//! shardline-repo's traits, so that case is a `compile_fail` example on its `NewRow`): each `ui/*.rs`
//! must fail to compile with exactly the errors in its `.stderr` beside it (`TRYBUILD=overwrite`
//! rewrites them after a deliberate change of wording).

#[test]
fn declarations_that_cannot_work_do_not_compile() {
    trybuild::TestCases::new().compile_fail("tests/ui/*.rs");
}
