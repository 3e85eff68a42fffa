//! `#[derive(Entity)]` and `#[derive(NewRow)]` for `shardline-repo`; use them through
//! `shardline_repo::{Entity, NewRow}`, which re-exports them beside the traits.
//!
//! ```text
//! #[derive(Entity)]
//! #[shardline(table = "photos")]
//! struct Photo {
//!     id: Id,
//!     #[shardline(user)]
//!     user_id: i64,
//!     url: String,
//! }
//!
//! #[derive(NewRow)]
//! #[shardline(entity = Photo)]
//! struct NewPhoto {
//!     #[shardline(user)]
//!     user_id: i64,
//!     url: String,
//! }
//!
//! #[derive(Entity)]
//! #[shardline(table = "comments")]
//! struct Comment {
//!     id: Id,
//!     #[shardline(parent)]
//!     photo_id: Id,
//!     user_id: i64,
//!     body: String,
//! }
//! ```
//!
//! Attributes:
//! - on the struct: `table = "..."` (`Entity`, required), `entity = Type` (`NewRow`,
//!   required);
//! - on a field: `user` (the owning user: the row lives in the user's shard) or
//!   `parent` (an ID: the row lives in that row's shard), exactly one on a `NewRow`, at
//!   most one each on an `Entity`; `column = "..."`
//!   (the column's name when it is not the field's), `id` (`Entity`: the ID field when it
//!   is not named `id`).
//!
//! Table and column names (a field's name, or its `column = "..."`) must be plain SQL
//! identifiers: 1 to 63 bytes, a lowercase ASCII letter or `_` first, then lowercase ASCII
//! letters, digits and `_` (`shardline_id::sql::plain_identifier_problem`, the rule
//! `shardline-repo` checks again before it builds SQL), and no column may start with
//! `shardline_` (`shardline_id::sql::RESERVED_COLUMN_PREFIX`: the columns shardline's
//! statements add to their rows). Any other name is a compile error at the attribute or
//! field, naming the name and the fix. A raw field name (`r#type`) is the column
//! without its `r#`.

use proc_macro::TokenStream;
use proc_macro2::Span;
use quote::quote;
use shardline_id::sql::{RESERVED_COLUMN_PREFIX, plain_identifier_problem};
use syn::ext::IdentExt as _;
use syn::{Data, DeriveInput, Fields, Ident, LitStr, Path, spanned::Spanned as _};

/// Implements `shardline_repo::Entity` for a struct with named fields.
#[proc_macro_derive(Entity, attributes(shardline))]
pub fn derive_entity(input: TokenStream) -> TokenStream {
    let input = syn::parse_macro_input!(input as DeriveInput);
    entity(&input).unwrap_or_else(syn::Error::into_compile_error).into()
}

/// Implements `shardline_repo::NewRow` for a struct with named fields.
#[proc_macro_derive(NewRow, attributes(shardline))]
pub fn derive_new_row(input: TokenStream) -> TokenStream {
    let input = syn::parse_macro_input!(input as DeriveInput);
    new_row(&input).unwrap_or_else(syn::Error::into_compile_error).into()
}

#[derive(Default)]
struct StructAttrs {
    table: Option<LitStr>,
    entity: Option<Path>,
}

struct Field {
    ident: Ident,
    column: String,
    /// Where the column's name was written: the field's name, or its `column = "..."`.
    column_span: Span,
    /// Named by `column = "..."` rather than by the field.
    renamed: bool,
    user: bool,
    parent: bool,
    id: bool,
}

fn struct_attrs(input: &DeriveInput) -> syn::Result<StructAttrs> {
    let mut out = StructAttrs::default();
    for attr in input.attrs.iter().filter(|a| a.path().is_ident("shardline")) {
        attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("table") {
                if out.table.replace(meta.value()?.parse()?).is_some() {
                    return Err(meta.error("`table` is given twice"));
                }
                Ok(())
            } else if meta.path.is_ident("entity") {
                if out.entity.replace(meta.value()?.parse()?).is_some() {
                    return Err(meta.error("`entity` is given twice"));
                }
                Ok(())
            } else {
                Err(meta.error("unknown shardline attribute; expected `table = \"...\"` or `entity = Type`"))
            }
        })?;
    }
    Ok(out)
}

fn fields(input: &DeriveInput) -> syn::Result<Vec<Field>> {
    let Data::Struct(data) = &input.data else {
        return Err(syn::Error::new(input.span(), "shardline derives work on structs only"));
    };
    let Fields::Named(named) = &data.fields else {
        return Err(syn::Error::new(input.span(), "shardline derives need a struct with named fields"));
    };
    let mut out = Vec::new();
    for f in &named.named {
        let Some(ident) = f.ident.clone() else { continue };
        let mut field = Field {
            column: ident.unraw().to_string(),
            column_span: ident.span(),
            renamed: false,
            ident,
            user: false,
            parent: false,
            id: false,
        };
        for attr in f.attrs.iter().filter(|a| a.path().is_ident("shardline")) {
            attr.parse_nested_meta(|meta| {
                let flag = |set: &mut bool, name: &str| {
                    if std::mem::replace(set, true) {
                        Err(meta.error(format!("`{name}` is given twice")))
                    } else {
                        Ok(())
                    }
                };
                if meta.path.is_ident("user") {
                    flag(&mut field.user, "user")
                } else if meta.path.is_ident("parent") {
                    flag(&mut field.parent, "parent")
                } else if meta.path.is_ident("id") {
                    flag(&mut field.id, "id")
                } else if meta.path.is_ident("column") {
                    if field.renamed {
                        return Err(meta.error("`column` is given twice"));
                    }
                    let name: LitStr = meta.value()?.parse()?;
                    field.column = name.value();
                    field.column_span = name.span();
                    field.renamed = true;
                    Ok(())
                } else {
                    Err(meta.error("unknown shardline field attribute; expected `user`, `parent`, `id` or `column = \"...\"`"))
                }
            })?;
        }
        if field.user
            && let syn::Type::Path(t) = &f.ty
            && t.qself.is_none()
            && let Some(small) = t.path.get_ident().filter(|i| SMALL_INTEGERS.iter().any(|s| *i == s))
        {
            // `Into<i64>` takes them, but the repository reads and binds a user key as
            // `bigint`: a batch insert and a user's page would fail at run time.
            return Err(syn::Error::new(
                small.span(),
                format!("a user key is a bigint column read as i64, not {small}: make the field i64"),
            ));
        }
        if let Some(first) = out.iter().find(|o: &&Field| o.column == field.column) {
            return Err(syn::Error::new(
                field.column_span,
                format!("column `{}` is already the column of field `{}`", field.column, first.ident),
            ));
        }
        out.push(field);
    }
    Ok(out)
}

/// Integer types that convert into `i64` but are not a `bigint` column's.
const SMALL_INTEGERS: &[&str] = &["i8", "i16", "i32", "u8", "u16", "u32"];

/// A compile error unless `table` is a plain SQL identifier.
fn check_table(table: &LitStr) -> syn::Result<()> {
    let name = table.value();
    match plain_identifier_problem(&name) {
        None => Ok(()),
        Some(problem) => Err(syn::Error::new(
            table.span(),
            format!(
                "table `{name}` is not a plain SQL identifier: it {problem}; \
                 fix #[shardline(table = \"...\")]"
            ),
        )),
    }
}

/// A compile error unless every column is a plain SQL identifier, at the first that is
/// not: at its `column = "..."`, or at the field that names it.
fn check_columns(fields: &[Field]) -> syn::Result<()> {
    for f in fields {
        let (name, fix) = if f.renamed {
            (format!("column `{}`", f.column), "fix #[shardline(column = \"...\")]")
        } else {
            (
                format!("column `{}` (the field's name)", f.column),
                "name the column with #[shardline(column = \"...\")]",
            )
        };
        if let Some(problem) = plain_identifier_problem(&f.column) {
            return Err(syn::Error::new(
                f.column_span,
                format!("{name} is not a plain SQL identifier: it {problem}; {fix}"),
            ));
        }
        if f.column.starts_with(RESERVED_COLUMN_PREFIX) {
            return Err(syn::Error::new(
                f.column_span,
                format!(
                    "{name} starts with `{RESERVED_COLUMN_PREFIX}`, reserved for the columns shardline's \
                     statements add to their rows; {fix}"
                ),
            ));
        }
    }
    Ok(())
}

/// The field marked `what` (`user` or `parent`), if any; an error if several are.
fn marked<'f>(fields: &'f [Field], what: &str, pick: fn(&Field) -> bool) -> syn::Result<Option<&'f Field>> {
    let mut found = fields.iter().filter(|f| pick(f));
    match (found.next(), found.next()) {
        (first, None) => Ok(first),
        (Some(_), Some(second)) => {
            Err(syn::Error::new(second.ident.span(), format!("only one field can be #[shardline({what})]")))
        }
        (None, Some(_)) => Ok(None),
    }
}

fn optional_column(field: Option<&Field>) -> proc_macro2::TokenStream {
    match field {
        Some(f) => {
            let c = &f.column;
            quote! { ::core::option::Option::Some(#c) }
        }
        None => quote! { ::core::option::Option::None },
    }
}

fn entity(input: &DeriveInput) -> syn::Result<proc_macro2::TokenStream> {
    let attrs = struct_attrs(input)?;
    let Some(table) = attrs.table else {
        return Err(syn::Error::new(
            input.ident.span(),
            "#[derive(Entity)] needs #[shardline(table = \"...\")]",
        ));
    };
    check_table(&table)?;
    let fields = fields(input)?;
    check_columns(&fields)?;
    let (user, parent) = (marked(&fields, "user", |f| f.user)?, marked(&fields, "parent", |f| f.parent)?);
    if let (Some(_), Some(p)) = (user, parent) {
        // Rows are placed by one of them: the other's pages would read the wrong shards.
        return Err(syn::Error::new(
            p.ident.span(),
            "an entity's rows are placed by their user or by their parent, not both: mark one (the other stays a plain column)",
        ));
    }
    let (user, parent) = (optional_column(user), optional_column(parent));
    let marked: Vec<&Field> = fields.iter().filter(|f| f.id).collect();
    let id = match marked.as_slice() {
        [one] => *one,
        [] => fields.iter().find(|f| f.ident.unraw() == "id").ok_or_else(|| {
            syn::Error::new(
                input.ident.span(),
                "an entity needs an `id` field, or one marked #[shardline(id)]",
            )
        })?,
        [_, second, ..] => {
            return Err(syn::Error::new(second.ident.span(), "only one field can be #[shardline(id)]"));
        }
    };
    if id.column != "id" {
        return Err(syn::Error::new(id.ident.span(), "the ID field's column must be `id`"));
    }
    let name = &input.ident;
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    let columns: Vec<&str> = fields.iter().map(|f| f.column.as_str()).collect();
    let reads = fields.iter().map(|f| {
        let (ident, column) = (&f.ident, &f.column);
        quote! { #ident: row.try_get(#column)? }
    });
    let id_ident = &id.ident;
    Ok(quote! {
        impl #impl_generics ::shardline_repo::entity::Entity for #name #ty_generics #where_clause {
            const TABLE: &'static str = #table;
            const COLUMNS: &'static [&'static str] = &[#(#columns),*];
            const USER_COLUMN: ::core::option::Option<&'static str> = #user;
            const PARENT_COLUMN: ::core::option::Option<&'static str> = #parent;
            fn from_row(
                row: &::shardline_repo::tokio_postgres::Row,
            ) -> ::core::result::Result<Self, ::shardline_repo::tokio_postgres::Error> {
                ::core::result::Result::Ok(Self { #(#reads),* })
            }
            fn id(&self) -> ::shardline_repo::Id {
                self.#id_ident
            }
        }
    })
}

fn new_row(input: &DeriveInput) -> syn::Result<proc_macro2::TokenStream> {
    let attrs = struct_attrs(input)?;
    let Some(entity) = attrs.entity else {
        return Err(syn::Error::new(
            input.ident.span(),
            "#[derive(NewRow)] needs #[shardline(entity = Type)]",
        ));
    };
    let fields = fields(input)?;
    check_columns(&fields)?;
    let (key, placed_by) = match (
        marked(&fields, "user", |f| f.user)?,
        marked(&fields, "parent", |f| f.parent)?,
    ) {
        (Some(u), None) => {
            let ident = &u.ident;
            (
                quote! { ::shardline_repo::ShardKey::User(::core::convert::Into::<i64>::into(self.#ident)) },
                (u, "user", quote! { USER_COLUMN }, quote! { PARENT_COLUMN }),
            )
        }
        (None, Some(p)) => {
            let ident = &p.ident;
            (
                quote! { ::shardline_repo::ShardKey::Parent(self.#ident) },
                (p, "parent", quote! { PARENT_COLUMN }, quote! { USER_COLUMN }),
            )
        }
        (Some(_), Some(p)) => {
            return Err(syn::Error::new(
                p.ident.span(),
                "a row is placed by its user or by its parent, not both",
            ));
        }
        (None, None) => {
            return Err(syn::Error::new(
                input.ident.span(),
                "mark the field that places the row: #[shardline(user)] (a user ID) or #[shardline(parent)] (an ID)",
            ));
        }
    };
    if let Some(id) = fields.iter().find(|f| f.column == "id" || f.id) {
        return Err(syn::Error::new(id.ident.span(), "a new row has no ID: the shard mints it"));
    }
    let name = &input.ident;
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    let columns: Vec<&str> = fields.iter().map(|f| f.column.as_str()).collect();
    let values = fields.iter().map(|f| &f.ident);
    // The row's key must be stored in the column the entity's pages read by (its
    // `#[shardline(user)]` or `#[shardline(parent)]` one): placed by another, a row lands
    // in a shard those pages never look in. Checked when the type checks, by the compiler.
    let (field, kind, entity_column, other_column) = placed_by;
    let column = &field.column;
    let entity_name = quote!(#entity).to_string().replace(' ', "");
    let message = format!(
        "{name} places its rows by its {kind} `{column}`, but {entity_name} has no #[shardline({kind})] field stored in `{column}`: mark the same column in both"
    );
    let same = quote! {
        ::shardline_repo::entity::same_column(
            <#entity as ::shardline_repo::entity::Entity>::#entity_column,
            <#entity as ::shardline_repo::entity::Entity>::#other_column,
            #column,
        )
    };
    let check = if input.generics.params.is_empty() {
        quote! { const _: () = ::core::assert!(#same, #message); }
    } else {
        quote! {}
    };
    let check_generic = if input.generics.params.is_empty() {
        quote! {}
    } else {
        quote! { const { ::core::assert!(#same, #message) }; }
    };
    Ok(quote! {
        #check
        impl #impl_generics ::shardline_repo::entity::NewRow for #name #ty_generics #where_clause {
            type Entity = #entity;
            const COLUMNS: &'static [&'static str] = &[#(#columns),*];
            fn shard_key(&self) -> ::shardline_repo::ShardKey {
                #check_generic
                #key
            }
            fn values(&self) -> ::std::vec::Vec<&(dyn ::shardline_repo::tokio_postgres::types::ToSql + ::core::marker::Sync)> {
                ::std::vec![#(&self.#values),*]
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entity_err(input: DeriveInput) -> String {
        entity(&input).err().map(|e| e.to_string()).unwrap_or_default()
    }

    fn new_row_err(input: DeriveInput) -> String {
        new_row(&input).err().map(|e| e.to_string()).unwrap_or_default()
    }

    #[test]
    fn an_entity_declares_its_columns_in_field_order() {
        let out = entity(&syn::parse_quote! {
            #[shardline(table = "comments")]
            struct Comment { id: Id, #[shardline(parent)] photo_id: Id, #[shardline(column = "author")] user_id: i64 }
        })
        .unwrap()
        .to_string();
        assert!(out.contains(r#"& ["id" , "photo_id" , "author"]"#), "{out}");
        assert!(out.contains(r#"PARENT_COLUMN : :: core :: option :: Option < & 'static str > = :: core :: option :: Option :: Some ("photo_id")"#), "{out}");
        assert!(out.contains("USER_COLUMN : :: core :: option :: Option < & 'static str > = :: core :: option :: Option :: None"), "{out}");
        assert!(out.contains(r#"user_id : row . try_get ("author") ?"#), "{out}");
    }

    #[test]
    fn names_that_are_not_plain_identifiers_are_refused_with_the_fix() {
        let long = "a".repeat(64);
        for bad in ["Photos", "photo s", "photos\"; drop table x; --", "0photos", "", "phötos", long.as_str()]
        {
            let err = entity_err(syn::parse_quote! { #[shardline(table = #bad)] struct P { id: Id } });
            assert!(err.starts_with(&format!("table `{bad}` is not a plain SQL identifier: it ")), "{err}");
            assert!(err.ends_with("; fix #[shardline(table = \"...\")]"), "{err}");
            let err = new_row_err(syn::parse_quote! {
                #[shardline(entity = P)] struct N { #[shardline(user)] u: i64, #[shardline(column = #bad)] c: i64 }
            });
            assert!(err.starts_with(&format!("column `{bad}` is not a plain SQL identifier: it ")), "{err}");
        }
        assert_eq!(
            entity_err(syn::parse_quote! { #[shardline(table = "p")] struct P { id: Id, Caption: String } }),
            "column `Caption` (the field's name) is not a plain SQL identifier: it must start with a \
             lowercase ASCII letter or an underscore; name the column with #[shardline(column = \"...\")]"
        );
        assert_eq!(
            entity_err(syn::parse_quote! { #[shardline(table = #long)] struct P { id: Id } }),
            format!(
                "table `{long}` is not a plain SQL identifier: it must be 1 to 63 bytes; fix #[shardline(table = \"...\")]"
            )
        );
        // The edges that pass: 63 bytes, a leading `_`, digits after the first byte, `pg_`
        // (reserved for schemas only), a raw identifier's name without its `r#`.
        let ok = "b".repeat(63);
        for good in [ok.as_str(), "_photos", "photos_2", "pg_photos"] {
            let out = entity(&syn::parse_quote! {
                #[shardline(table = #good)] struct P { id: Id, #[shardline(column = #good)] c: i64, r#type: i64 }
            });
            assert!(out.is_ok(), "{good:?}: {:?}", out.err().map(|e| e.to_string()));
            assert!(out.unwrap().to_string().contains(r#"["id" , "#), "{good:?}");
        }
        let out = entity(&syn::parse_quote! { #[shardline(table = "p")] struct P { id: Id, r#type: i64 } })
            .unwrap();
        assert!(out.to_string().contains(r#"& ["id" , "type"]"#), "{out}");
    }

    #[test]
    fn a_column_under_the_reserved_prefix_is_refused_and_a_raw_id_field_is_the_id() {
        for reserved in ["shardline_shard", "shardline_part", "shardline_x"] {
            let err = entity_err(syn::parse_quote! {
                #[shardline(table = "p")] struct P { id: Id, #[shardline(column = #reserved)] c: i64 }
            });
            assert_eq!(
                err,
                format!(
                    "column `{reserved}` starts with `shardline_`, reserved for the columns shardline's \
                     statements add to their rows; fix #[shardline(column = \"...\")]"
                )
            );
            let err = new_row_err(syn::parse_quote! {
                #[shardline(entity = P)] struct N { #[shardline(user)] u: i64, #[shardline(column = #reserved)] c: i64 }
            });
            assert!(err.starts_with(&format!("column `{reserved}` starts with `shardline_`")), "{err}");
        }
        let err = entity_err(
            syn::parse_quote! { #[shardline(table = "p")] struct P { id: Id, shardline_shard: i32 } },
        );
        assert!(err.starts_with("column `shardline_shard` (the field's name) starts with"), "{err}");
        // `r#id` is the field `id`: the entity's ID, read from column `id`.
        let out = entity(&syn::parse_quote! { #[shardline(table = "p")] struct P { r#id: Id, n: i64 } })
            .map_err(|e| e.to_string())
            .unwrap_or_else(|e| panic!("r#id refused: {e}"))
            .to_string();
        assert!(out.contains(r#"r#id : row . try_get ("id") ?"#), "{out}");
        assert!(out.contains("self . r#id"), "{out}");
    }

    #[test]
    fn bad_declarations_are_named() {
        assert_eq!(
            entity_err(syn::parse_quote! { struct P { id: Id } }),
            "#[derive(Entity)] needs #[shardline(table = \"...\")]"
        );
        assert_eq!(
            entity_err(syn::parse_quote! { #[shardline(table = "p")] struct P { key: Id } }),
            "an entity needs an `id` field, or one marked #[shardline(id)]"
        );
        assert_eq!(
            entity_err(syn::parse_quote! { #[shardline(table = "p")] struct P(Id); }),
            "shardline derives need a struct with named fields"
        );
        assert_eq!(
            entity_err(syn::parse_quote! { #[shardline(tabel = "p")] struct P { id: Id } }),
            "unknown shardline attribute; expected `table = \"...\"` or `entity = Type`"
        );
        assert_eq!(
            entity_err(syn::parse_quote! {
                #[shardline(table = "p")] struct P { id: Id, #[shardline(user)] a: i64, #[shardline(user)] b: i64 }
            }),
            "only one field can be #[shardline(user)]"
        );
        assert_eq!(
            new_row_err(syn::parse_quote! { #[shardline(entity = P)] struct N { url: String } }),
            "mark the field that places the row: #[shardline(user)] (a user ID) or #[shardline(parent)] (an ID)"
        );
        assert_eq!(
            new_row_err(syn::parse_quote! {
                #[shardline(entity = P)] struct N { #[shardline(user)] u: i64, #[shardline(parent)] p: Id }
            }),
            "a row is placed by its user or by its parent, not both"
        );
        assert_eq!(
            new_row_err(
                syn::parse_quote! { #[shardline(entity = P)] struct N { id: Id, #[shardline(user)] u: i64 } }
            ),
            "a new row has no ID: the shard mints it"
        );
        assert_eq!(
            new_row_err(syn::parse_quote! { struct N { #[shardline(user)] u: i64 } }),
            "#[derive(NewRow)] needs #[shardline(entity = Type)]"
        );
    }
}
