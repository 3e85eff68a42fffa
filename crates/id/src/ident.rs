//! SQL names and literals: the one place shardline quotes what it writes into SQL text.
//!
//! Values are bind parameters wherever Postgres takes them. Names (schemas, tables,
//! columns, roles, subscriptions) cannot be, and some statements (DDL, `CREATE
//! SUBSCRIPTION ... CONNECTION '...'`) take no parameters at all: those are formatted in,
//! always through [`Ident`] and [`literal`].
//!
//! ```
//! use shardline_id::ident::{Ident, literal};
//!
//! let schema = Ident::new("shard_0042")?;
//! assert_eq!(format!("DROP SCHEMA {schema}"), r#"DROP SCHEMA "shard_0042""#);
//! assert!(Ident::new("Robert'); DROP TABLE students;--").is_err());
//! // A name read back from the database may be anything Postgres allows: quoted, escaped.
//! assert_eq!(Ident::from_database(r#"odd"name"#).to_string(), r#""odd""name""#);
//! assert_eq!(literal("it's"), "'it''s'");
//! assert_eq!(literal(r"a\b"), r"E'a\\b'");
//! # Ok::<(), shardline_id::Error>(())
//! ```

use std::fmt;

use crate::sql::plain_identifier_problem;
use crate::{Error, Result};

/// A SQL identifier. Formatted, it is double-quoted with any `"` inside doubled, so it
/// always means exactly this name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ident(String);

impl Ident {
    /// A name shardline makes or a user gives: it must be a plain identifier (1 to 63
    /// bytes of lowercase ASCII letters, digits and `_`, not starting with a digit), so the
    /// quoted form and the unquoted one name the same thing.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidIdentifier`] naming the name and what is wrong with it.
    pub fn new(name: impl Into<String>) -> Result<Ident> {
        let name = name.into();
        match plain_identifier_problem(&name) {
            None => Ok(Ident(name)),
            Some(reason) => Err(Error::InvalidIdentifier { name, reason }),
        }
    }

    /// A name read back from a database (a table listed in `pg_class`, a schema named in
    /// the journal): not checked, since Postgres made it, but quoted and escaped all the
    /// same.
    pub fn from_database(name: impl Into<String>) -> Ident {
        Ident(name.into())
    }

    /// The name, unquoted.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Ident {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("\"")?;
        f.write_str(&self.0.replace('"', "\"\""))?;
        f.write_str("\"")
    }
}

/// `name` quoted as a SQL identifier (see [`Ident::from_database`]).
pub fn quote(name: &str) -> String {
    Ident::from_database(name).to_string()
}

/// A SQL string literal holding exactly `text`: `'text'` with each `'` doubled; when
/// `text` holds a backslash, an escape string `E'...'` with backslashes doubled too, so
/// it reads the same whatever `standard_conforming_strings` says (as Postgres's own
/// `quote_literal`).
pub fn literal(text: &str) -> String {
    let quoted = text.replace('\'', "''");
    if text.contains('\\') { format!("E'{}'", quoted.replace('\\', "\\\\")) } else { format!("'{quoted}'") }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_literals_round_trip_through_quoting() {
        for name in ["plain", "with\"quote", "Upper Case", "x\"\"y", ""] {
            let q = quote(name);
            assert!(q.starts_with('"') && q.ends_with('"'));
            assert_eq!(q[1..q.len() - 1].replace("\"\"", "\""), name);
        }
        assert!(matches!(Ident::new("Bad"), Err(Error::InvalidIdentifier { .. })));
        assert_eq!(Ident::new("good_1").map(|i| i.to_string()).ok().as_deref(), Some("\"good_1\""));
        assert_eq!(literal("plain"), "'plain'");
        assert_eq!(literal("o'clock"), "'o''clock'");
        assert_eq!(literal("c:\\x'y"), "E'c:\\\\x''y'");
    }
}
