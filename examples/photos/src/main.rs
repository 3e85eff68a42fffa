//! The example application as a program: `cargo run -p shardline-example-photos --
//! shardline.toml` posts a photo, likes and comments it, and reads it all back, on the
//! cluster the config names (after `shardline init`).

use std::process::ExitCode;

use shardline_example_photos::{Comment, Like, NewComment, NewLike, NewPhoto, Photo};
use shardline_repo::{Cluster, ClusterOptions};

#[tokio::main]
async fn main() -> ExitCode {
    let path = std::env::args().nth(1).unwrap_or_else(|| "shardline.toml".to_owned());
    match run(&path).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(path: &str) -> Result<(), Box<dyn std::error::Error>> {
    let text = std::fs::read_to_string(path)?;
    let base = std::path::Path::new(path).parent().unwrap_or(std::path::Path::new("."));
    let config = shardline_router::Config::from_toml(&text, path, base, &|var| std::env::var(var).ok())?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    let (photos, likes, comments) =
        (cluster.repo::<Photo>()?, cluster.repo::<Like>()?, cluster.repo::<Comment>()?);

    let photo = photos.insert(&NewPhoto::numbered(42, 1)).await?;
    let route = cluster.route_id(photo.id)?;
    println!(
        "photo {} of user 42: shard {}, schema {}, host {}",
        photo.id, route.shard, route.schema, route.host
    );
    likes
        .insert_many(&(100..103).map(|user_id| NewLike { photo_id: photo.id, user_id }).collect::<Vec<_>>())
        .await?;
    comments.insert(&NewComment { photo_id: photo.id, user_id: 7, body: "what a view".into() }).await?;

    let page = comments.page_of_parent(photo.id, None, 20).await?;
    let liked = likes.page_of_parent(photo.id, None, 100).await?;
    println!(
        "{} likes, {} comment(s): {:?}",
        liked.rows.len(),
        page.rows.len(),
        page.rows.first().map(|c| &c.body)
    );
    Ok(())
}
