//! Privileges: what the application's roles get, and what a moved shard carries.
//!
//! - [`shard_grants`] is the one place that says which privileges an application role
//!   (the config's `app_roles`) gets on a shard schema. [`crate::converge`] runs it in
//!   the same transaction as the schema, minter and migrations it applies, so `init`,
//!   `migrate` and a move's target all grant alike, and a table a migration creates is
//!   granted before anyone can see it. The ledger records it as [`GRANTS`], with the
//!   checksum of the statements, so adding a role to `app_roles` makes the next
//!   `migrate` grant every shard.
//! - [`catalog_grants`]: reading the catalog, which routing needs.
//! - [`host_grants`]: calling `shardline.resolve_fence` on each host.
//! - [`read_acl`] and [`carry`]: a move makes the target's privileges on the shard's
//!   schema, tables, sequences, columns and routines those of the source, whoever
//!   granted them (an application role or a hand-made grant).
//!
//! Why re-grant in the shard's transaction rather than `ALTER DEFAULT PRIVILEGES`:
//! default privileges apply only to objects created later by the role they name, so
//! they miss a migration run by another operator role and every object that exists
//! already; a move's target is built by whatever role the move connects as. A grant in
//! the migration's own transaction covers every table whoever creates it, and commits
//! (or rolls back) with it.

use std::collections::{BTreeMap, BTreeSet};

use shardline_id::ident::quote as quote_ident;
use shardline_repo::Catalog;
use shardline_router::{HostName, RoleName, SchemaName};
use tokio_postgres::Client;

use crate::{Error, Result, describe};

/// The ledger's name for the application roles' grants on a shard. Its checksum is
/// that of [`shard_grants`]'s statements, so a change of `app_roles` (or of what they
/// get) re-grants every shard on the next `migrate`.
pub const GRANTS: &str = "shardline grants";

/// The catalog tables the request path reads (routing, the map, the moves).
pub const CATALOG_TABLES: [&str; 4] = ["cluster", "hosts", "shards", "moves"];

/// The statements that grant each of `roles` exactly what the request path needs on
/// shard schema `schema`, and nothing else: `USAGE` on the schema; `SELECT, INSERT,
/// UPDATE, DELETE` on every table; `USAGE, SELECT` on every sequence (`nextval` needs
/// `USAGE`; the minter's catch-up is `SECURITY DEFINER`, so it moves the sequence as its
/// owner and the role needs no `UPDATE`), but none on the minter's
/// `shardline_catch_up_due` (its catch-up backoff: a role that could take values from it
/// could hold off every session's catch-up); `EXECUTE` on every routine (the minter's
/// `next_id`, `shardline_catch_up`, `reserve_ids`, `id_parts`, and any a migration
/// makes). Empty when `roles` is.
///
/// Idempotent: granting again changes nothing. Run it after the schema's objects exist
/// (it covers the objects present when it runs).
pub fn shard_grants(schema: &SchemaName, roles: &[RoleName]) -> String {
    if roles.is_empty() {
        return String::new();
    }
    let s = schema.quoted();
    let to = roles.iter().map(RoleName::quoted).collect::<Vec<_>>().join(", ");
    format!(
        "GRANT USAGE ON SCHEMA {s} TO {to};
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {s} TO {to};
GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA {s} TO {to};
REVOKE ALL ON SEQUENCE {s}.shardline_catch_up_due FROM {to};
GRANT EXECUTE ON ALL ROUTINES IN SCHEMA {s} TO {to}"
    )
}

/// The statements that let each of `roles` read what routing needs from the catalog:
/// `USAGE` on schema `shardline` and `SELECT` on [`CATALOG_TABLES`]. Empty when `roles`
/// is.
pub fn catalog_grants(roles: &[RoleName]) -> String {
    if roles.is_empty() {
        return String::new();
    }
    let to = roles.iter().map(RoleName::quoted).collect::<Vec<_>>().join(", ");
    let tables = CATALOG_TABLES.iter().map(|t| format!("shardline.{t}")).collect::<Vec<_>>().join(", ");
    format!("GRANT USAGE ON SCHEMA shardline TO {to};\nGRANT SELECT ON {tables} TO {to}")
}

/// The statement that lets each of `roles` call what a host offers every router:
/// `USAGE` on the host's schema `shardline`, for `shardline.resolve_fence` (executable
/// by `PUBLIC`), which finishes or undoes a move's fence whose lease ran out. Empty when
/// `roles` is.
pub fn host_grants(roles: &[RoleName]) -> String {
    if roles.is_empty() {
        return String::new();
    }
    let to = roles.iter().map(RoleName::quoted).collect::<Vec<_>>().join(", ");
    format!("GRANT USAGE ON SCHEMA shardline TO {to}")
}

/// The catalog's connection, for this module's two statements there (the roles'
/// existence and [`catalog_grants`]): privileges are this module's, wherever they are.
#[expect(clippy::disallowed_methods, reason = "grants owns the application roles' privileges on the catalog")]
fn catalog_client(catalog: &Catalog) -> &Client {
    catalog.lend()
}

/// Which of `roles` do not exist on the catalog's server.
pub(crate) async fn catalog_missing_roles(
    catalog: &Catalog,
    roles: &[String],
) -> std::result::Result<Vec<String>, tokio_postgres::Error> {
    missing_roles(catalog_client(catalog), roles).await
}

/// Grants `roles` what routing reads in the catalog ([`catalog_grants`]); nothing when
/// `roles` is empty.
pub(crate) async fn grant_catalog(
    catalog: &Catalog,
    roles: &[RoleName],
) -> std::result::Result<(), tokio_postgres::Error> {
    let sql = catalog_grants(roles);
    if sql.is_empty() {
        return Ok(());
    }
    catalog_client(catalog).batch_execute(&sql).await
}

/// Which of `roles` do not exist on `client`'s server.
pub(crate) async fn missing_roles(
    client: &Client,
    roles: &[String],
) -> std::result::Result<Vec<String>, tokio_postgres::Error> {
    if roles.is_empty() {
        return Ok(Vec::new());
    }
    Ok(client
        .query(
            "SELECT r FROM unnest($1::text[]) WITH ORDINALITY AS u(r, i)
              WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = r) ORDER BY i",
            &[&roles],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

/// What a privilege is on.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Object {
    Schema,
    /// A table, view, materialized view or foreign table (quoted name).
    Table(String),
    /// A sequence (quoted name).
    Sequence(String),
    /// A column of a table (quoted names).
    Column(String, String),
    /// A function, procedure or aggregate: quoted name and identity arguments.
    Routine(String),
}

/// One privilege held on an object of a shard schema, by a role other than the
/// object's owner (whose rights are implicit).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Privilege {
    object: Object,
    /// The role, or `None` for `PUBLIC`.
    grantee: Option<String>,
    /// `SELECT`, `EXECUTE`, ...
    privilege: String,
}

/// The privileges on a schema's objects, each with whether it may be granted on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Acl {
    held: BTreeMap<Privilege, bool>,
    /// The owners of the schema and its objects (their own rights are not listed).
    owners: BTreeSet<String>,
}

impl Acl {
    /// The roles named as grantees (not `PUBLIC`).
    pub(crate) fn grantees(&self) -> BTreeSet<String> {
        self.held.keys().filter_map(|p| p.grantee.clone()).collect()
    }
}

/// The privilege words Postgres reports (`aclexplode`); anything else is refused
/// rather than spliced into a statement.
const PRIVILEGES: [&str; 11] = [
    "SELECT",
    "INSERT",
    "UPDATE",
    "DELETE",
    "TRUNCATE",
    "REFERENCES",
    "TRIGGER",
    "EXECUTE",
    "USAGE",
    "CREATE",
    "MAINTAIN",
];

/// Every privilege on schema `schema` and its relations, columns and routines,
/// defaults included (`acldefault`: a routine's `EXECUTE` for `PUBLIC` unless revoked),
/// except each owner's own. Read with the schema first on `search_path`, so routine
/// signatures name the schema's own types unqualified and read alike on two hosts
/// whatever the schema is called there.
pub(crate) async fn read_acl(client: &Client, host: &HostName, schema: &str) -> Result<Acl> {
    let fail = |what: &str| {
        let (host, what) = (host.clone(), what.to_owned());
        move |e: tokio_postgres::Error| {
            let (sqlstate, message) = describe(&e);
            Error::Host { host: host.to_string(), what: what.clone(), sqlstate, message }
        }
    };
    let what = format!("read the privileges on {schema}");
    client
        .batch_execute(&format!(
            "BEGIN READ ONLY; SET LOCAL search_path TO {}, pg_catalog",
            quote_ident(schema)
        ))
        .await
        .map_err(fail(&what))?;
    let rows = client
        .query(
            r#"WITH n AS (SELECT oid, nspowner, nspacl FROM pg_namespace WHERE nspname = $1),
            acl AS (
                SELECT 'schema' AS kind, '' AS name, NULL::text AS col, n.nspowner AS owner, a.*
                  FROM n, LATERAL aclexplode(coalesce(n.nspacl, acldefault('n', n.nspowner))) a
                UNION ALL
                SELECT CASE WHEN c.relkind = 'S' THEN 'sequence' ELSE 'table' END, quote_ident(c.relname), NULL,
                       c.relowner, a.*
                  FROM n JOIN pg_class c ON c.relnamespace = n.oid,
                       LATERAL aclexplode(coalesce(c.relacl,
                           acldefault(CASE WHEN c.relkind = 'S' THEN 's' ELSE 'r' END::"char", c.relowner))) a
                 WHERE c.relkind IN ('r', 'p', 'v', 'm', 'f', 'S')
                UNION ALL
                SELECT 'column', quote_ident(c.relname), quote_ident(t.attname), c.relowner, a.*
                  FROM n JOIN pg_class c ON c.relnamespace = n.oid
                  JOIN pg_attribute t ON t.attrelid = c.oid AND t.attnum > 0 AND NOT t.attisdropped,
                       LATERAL aclexplode(t.attacl) a
                 WHERE c.relkind IN ('r', 'p', 'v', 'm', 'f') AND t.attacl IS NOT NULL
                UNION ALL
                SELECT 'routine', quote_ident(p.proname) || '(' || pg_get_function_identity_arguments(p.oid) || ')',
                       NULL, p.proowner, a.*
                  FROM n JOIN pg_proc p ON p.pronamespace = n.oid,
                       LATERAL aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a
            )
            SELECT kind, name, col,
                   CASE WHEN grantee = 0 THEN NULL ELSE pg_get_userbyid(grantee)::text END,
                   privilege_type, is_grantable, pg_get_userbyid(owner)::text
              FROM acl"#,
            &[&schema],
        )
        .await;
    let ended = client.batch_execute("COMMIT").await;
    let rows = rows.map_err(fail(&what))?;
    ended.map_err(fail(&what))?;
    let mut acl = Acl::default();
    for r in rows {
        #[allow(clippy::type_complexity)]
        let decoded: std::result::Result<
            (String, Option<String>, Option<String>, Option<String>, String, bool, String),
            tokio_postgres::Error,
        > = (|| {
            Ok((
                r.try_get(0)?,
                r.try_get(1)?,
                r.try_get(2)?,
                r.try_get(3)?,
                r.try_get(4)?,
                r.try_get(5)?,
                r.try_get(6)?,
            ))
        })();
        let (kind, name, col, grantee, privilege, grantable, owner) = decoded.map_err(fail(&what))?;
        // A routine dropped while this ran has no identity (NULL): it is gone.
        let Some(name) = name else { continue };
        let object = match (kind.as_str(), col) {
            ("schema", _) => Object::Schema,
            ("table", _) => Object::Table(name),
            ("sequence", _) => Object::Sequence(name),
            ("column", Some(c)) => Object::Column(name, c),
            ("routine", _) => Object::Routine(name),
            (other, _) => {
                return Err(Error::Host {
                    host: host.to_string(),
                    what,
                    sqlstate: None,
                    message: format!("an unexpected kind of object: {other}"),
                });
            }
        };
        if !PRIVILEGES.contains(&privilege.as_str()) {
            return Err(Error::Host {
                host: host.to_string(),
                what,
                sqlstate: None,
                message: format!("an unknown privilege {privilege:?}"),
            });
        }
        if grantee.as_ref() != Some(&owner) {
            acl.held.insert(Privilege { object, grantee, privilege }, grantable);
        }
        acl.owners.insert(owner);
    }
    Ok(acl)
}

/// What turns the target's privileges into the source's.
#[derive(Debug, Default, PartialEq, Eq)]
struct Plan {
    /// What the target holds and the source does not (or not with grant option).
    revokes: Vec<String>,
    /// What the source holds and the target does not (or not with grant option).
    grants: Vec<String>,
    /// Column grants both hold, granted again after the revokes: a table's revoke takes
    /// its columns' grants along.
    regrants: Vec<String>,
}

impl Plan {
    /// Whether the two sides differ.
    fn differs(&self) -> bool {
        !self.revokes.is_empty() || !self.grants.is_empty()
    }

    /// The statements, in the order they must run.
    fn statements(self) -> Vec<String> {
        let mut out = self.revokes;
        out.extend(self.grants);
        out.extend(self.regrants);
        out
    }
}

/// The plan that turns `target`'s privileges on `schema` into `source`'s. A grant to
/// one of the target's owners is left out (its rights are implicit).
fn plan(source: &Acl, target: &Acl, schema: &SchemaName) -> Plan {
    let on = |o: &Object| match o {
        Object::Schema => format!("SCHEMA {}", schema.quoted()),
        Object::Table(t) | Object::Column(t, _) => format!("TABLE {}.{t}", schema.quoted()),
        Object::Sequence(s) => format!("SEQUENCE {}.{s}", schema.quoted()),
        Object::Routine(r) => format!("ROUTINE {}.{r}", schema.quoted()),
    };
    let what = |p: &Privilege| match &p.object {
        Object::Column(_, c) => format!("{} ({c})", p.privilege),
        _ => p.privilege.clone(),
    };
    let who = |p: &Privilege| p.grantee.as_deref().map_or_else(|| "PUBLIC".to_owned(), quote_ident);
    let mut out = Plan::default();
    for (p, &grantable) in &target.held {
        let (what, on, who) = (what(p), on(&p.object), who(p));
        match source.held.get(p) {
            None => out.revokes.push(format!("REVOKE {what} ON {on} FROM {who} CASCADE")),
            Some(false) if grantable => {
                out.revokes.push(format!("REVOKE GRANT OPTION FOR {what} ON {on} FROM {who} CASCADE"))
            }
            Some(_) => {}
        }
    }
    for (p, &grantable) in &source.held {
        if p.grantee.as_ref().is_some_and(|g| target.owners.contains(g)) {
            continue;
        }
        let option = if grantable { " WITH GRANT OPTION" } else { "" };
        let grant = format!("GRANT {} ON {} TO {}{option}", what(p), on(&p.object), who(p));
        if target.held.get(p) != Some(&grantable) {
            out.grants.push(grant);
        } else if matches!(p.object, Object::Column(..)) {
            out.regrants.push(grant);
        }
    }
    out
}

/// Makes the privileges on shard schema `schema` on the target (`dst`) those of the
/// source (`src`, where the schema is called `source_schema`: its own name, or the
/// fence's). One transaction on the target; checked afterwards. Returns how many
/// statements it ran (0 when the target already agreed).
///
/// # Errors
///
/// [`Error::Host`] naming the host whose statement failed (a grantee role missing on
/// the target is `42704`; the pre-flight checks for it), or naming the target when a
/// difference remains.
pub(crate) async fn carry(
    src: &Client,
    source: &HostName,
    source_schema: &str,
    dst: &Client,
    target: &HostName,
    schema: &SchemaName,
) -> Result<usize> {
    // Both at once: before the flip this runs while the shard's writes wait.
    let (wanted, have) =
        futures::try_join!(read_acl(src, source, source_schema), read_acl(dst, target, schema.as_str()))?;
    let plan_ = plan(&wanted, &have, schema);
    if !plan_.differs() {
        return Ok(0);
    }
    let statements = plan_.statements();
    let what = format!("carry the privileges on {schema}");
    let sql = format!(
        "BEGIN; SET LOCAL search_path TO {}, pg_catalog;\n{};\nCOMMIT",
        schema.quoted(),
        statements.join(";\n")
    );
    if let Err(e) = dst.batch_execute(&sql).await {
        let _ = dst.batch_execute("ROLLBACK").await;
        let (sqlstate, message) = describe(&e);
        return Err(Error::Host { host: target.to_string(), what, sqlstate, message });
    }
    let now = read_acl(dst, target, schema.as_str()).await?;
    let left = plan(&wanted, &now, schema);
    if left.differs() {
        let left: Vec<String> = left.revokes.into_iter().chain(left.grants).collect();
        return Err(Error::Host {
            host: target.to_string(),
            what,
            sqlstate: None,
            message: format!("the target's privileges still differ from the source's: {}", left.join("; ")),
        });
    }
    tracing::info!(%source, %target, %schema, statements = statements.len(), "carried the privileges");
    Ok(statements.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardline_router::{LogicalShard, SchemaPrefix, ShardCount};

    fn schema() -> SchemaName {
        let shard = LogicalShard::new(7, ShardCount::new(8).unwrap()).unwrap();
        SchemaPrefix::default().schema(shard)
    }

    #[test]
    fn the_app_roles_get_exactly_the_documented_privileges() {
        let roles = [RoleName::new("app").unwrap(), RoleName::new("web").unwrap()];
        assert_eq!(
            shard_grants(&schema(), &roles),
            "GRANT USAGE ON SCHEMA \"shard_0007\" TO \"app\", \"web\";
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA \"shard_0007\" TO \"app\", \"web\";
GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA \"shard_0007\" TO \"app\", \"web\";
REVOKE ALL ON SEQUENCE \"shard_0007\".shardline_catch_up_due FROM \"app\", \"web\";
GRANT EXECUTE ON ALL ROUTINES IN SCHEMA \"shard_0007\" TO \"app\", \"web\""
        );
        assert_eq!(shard_grants(&schema(), &[]), "");
        assert_eq!(
            catalog_grants(&roles[..1]),
            "GRANT USAGE ON SCHEMA shardline TO \"app\";
GRANT SELECT ON shardline.cluster, shardline.hosts, shardline.shards, shardline.moves TO \"app\""
        );
        assert_eq!(catalog_grants(&[]), "");
    }

    fn acl(owner: &str, held: &[(Object, Option<&str>, &str, bool)]) -> Acl {
        Acl {
            held: held
                .iter()
                .map(|(o, g, p, opt)| {
                    (
                        Privilege {
                            object: o.clone(),
                            grantee: g.map(str::to_owned),
                            privilege: (*p).into(),
                        },
                        *opt,
                    )
                })
                .collect(),
            owners: [owner.to_owned()].into(),
        }
    }

    #[test]
    fn carrying_makes_the_target_agree_with_the_source() {
        let t = || Object::Table("\"photos\"".into());
        let f = || Object::Routine("\"next_id\"()".into());
        let source = acl(
            "ops",
            &[
                (Object::Schema, Some("app"), "USAGE", false),
                (t(), Some("app"), "SELECT", false),
                (t(), Some("Reader"), "SELECT", true),
                (Object::Column("\"photos\"".into(), "\"url\"".into()), Some("audit"), "SELECT", false),
                (Object::Sequence("\"s\"".into()), Some("app"), "USAGE", false),
                (t(), Some("ops2"), "SELECT", false),
            ],
        );
        let target = acl(
            "ops2",
            &[
                (Object::Schema, Some("app"), "USAGE", false),
                (t(), Some("app"), "SELECT", false),
                (t(), Some("app"), "DELETE", false),
                (t(), Some("Reader"), "SELECT", false),
                (f(), None, "EXECUTE", false),
            ],
        );
        let p = plan(&source, &target, &schema());
        assert!(p.differs());
        assert_eq!(
            p.statements(),
            [
                "REVOKE DELETE ON TABLE \"shard_0007\".\"photos\" FROM \"app\" CASCADE",
                "REVOKE EXECUTE ON ROUTINE \"shard_0007\".\"next_id\"() FROM PUBLIC CASCADE",
                "GRANT SELECT ON TABLE \"shard_0007\".\"photos\" TO \"Reader\" WITH GRANT OPTION",
                "GRANT USAGE ON SEQUENCE \"shard_0007\".\"s\" TO \"app\"",
                "GRANT SELECT (\"url\") ON TABLE \"shard_0007\".\"photos\" TO \"audit\"",
            ]
        );
        let same = plan(&source, &source, &schema());
        assert!(!same.differs());
        assert_eq!(same.regrants, ["GRANT SELECT (\"url\") ON TABLE \"shard_0007\".\"photos\" TO \"audit\""]);
    }
}
