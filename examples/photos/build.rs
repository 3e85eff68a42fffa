//! The `query_as!` calls of `with_sqlx` are checked against `.sqlx/` (offline) or the
//! database `DATABASE_URL` names: compiled again when either changes.

fn main() {
    println!("cargo:rerun-if-changed=.sqlx");
    for var in ["DATABASE_URL", "SQLX_OFFLINE", "SQLX_OFFLINE_DIR"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
}
